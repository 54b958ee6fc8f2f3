"""vLLM's `vllm.v1.sample.logits_processor`: the batch-level logits processor interface (interface.py), its
helpers (builtin.py) and how nanoserve's engine runs such a processor (state.py). LLM(model,
logits_processors=[YourClass]) takes a class written for vLLM as it is."""
from nanoserve.v1.sample.logits_processor.builtin import (AdapterLogitsProcessor, RequestLogitsProcessor,
                                                          process_dict_updates)
from nanoserve.v1.sample.logits_processor.interface import (AddedRequest, BatchUpdate, LogitsProcessor,
                                                            MovedRequest, MoveDirectionality, RemovedRequest)

__all__ = ["AdapterLogitsProcessor", "AddedRequest", "BatchUpdate", "LogitsProcessor", "MoveDirectionality",
           "MovedRequest", "RemovedRequest", "RequestLogitsProcessor", "process_dict_updates"]
