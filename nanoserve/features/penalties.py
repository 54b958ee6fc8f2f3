"""vLLM's penalties: repetition (over the prompt and the output: a logit is divided by it if positive,
multiplied if not), frequency and presence (over the output: minus the penalty times how often, or whether,
the token was drawn). Each row's counts of drawn tokens live on the device and grow by the step's tokens
there: no step reads an output, however long, back from the host."""
import torch

from nanoserve.engine.features import LogitsProcessor, to_device


class Penalties(LogitsProcessor):
    def __init__(self, *args):
        super().__init__(*args)
        shape = (self.max_rows, self.vocab_size)
        self.counts = torch.zeros(shape, dtype=torch.int32, device=self.device)  # drawn tokens, per row
        self.in_prompt = torch.zeros(shape, dtype=torch.bool, device=self.device)
        self.factors = torch.zeros(3, self.max_rows, device=self.device)  # repetition, frequency, presence
        self.counted = [0] * self.max_rows  # how many drawn tokens each row's counts hold (host bookkeeping)

    def add(self, slot, seq):
        p = seq.params
        self.factors[:, slot] = torch.tensor([p.repetition_penalty, p.frequency_penalty, p.presence_penalty])
        self.in_prompt[slot] = False
        self.in_prompt[slot, to_device(seq.prompt_ids, torch.long, self.device)] = True
        self.counted[slot] = -1  # counted at its first apply

    def recount(self, slot: int, seq, step: int, fed) -> None:
        """Count slot's drawn tokens again from its output: when it joins, and after a step that drew for it
        was never processed (an error, Ctrl-C). fed(): its last drawn token, still on the device."""
        output = seq.output_ids[:step]
        self.counts[slot] = 0
        if output:
            ids = to_device(output, torch.long, self.device)
            self.counts[slot].index_put_((ids,), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
        if step > len(output):  # async scheduling: its last token is this step's input, not on the host yet
            self.counts[slot].index_put_((fed().long(),), torch.ones(1, dtype=torch.int32, device=self.device),
                                         accumulate=True)
        self.counted[slot] = step

    def apply(self, logits, rows):
        for r, (slot, seq, step) in enumerate(zip(rows.slot_ids, rows.seqs, rows.steps)):
            if self.counted[slot] != step:
                self.recount(slot, seq, step, lambda: rows.last_inputs()[rows.index[r:r + 1]])
            self.counted[slot] = step + 1  # once drawn() has run
        part, used = logits[rows.index], self.counts[rows.slots].float()
        present = used > 0
        repetition, frequency, presence = self.factors[:, rows.slots, None]
        seen = present | self.in_prompt[rows.slots]
        part = torch.where(seen, torch.where(part > 0, part / repetition, part * repetition), part)
        logits[rows.index] = part - frequency * used - presence * present

    def drawn(self, rows, tokens):
        ones = torch.ones_like(rows.slots, dtype=torch.int32)
        self.counts.index_put_((rows.slots, tokens[rows.index].long()), ones, accumulate=True)
