"""The engine: sampling, requests and sequences, the scheduler, the model runner, LLMEngine and LLM.
Uses every layer below it (model/, cache/, kernels/)."""
