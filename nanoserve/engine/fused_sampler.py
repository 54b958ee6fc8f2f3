"""Lesson 02's sampler without its per-step overheads: the parameters of a step's requests go to the
device in two copies from preallocated (pinned) host buffers instead of five new tensors, and `sample`
runs compiled: a few fused kernels instead of ~15 passes over [batch, vocab]. Same tokens."""
import torch

from nanoserve.engine.sampler import Sampler, sample


class FusedSampler(Sampler):
    def __init__(self, max_num_seqs: int, device, compiled: bool = True):
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        # rows: temperature, top_p | top_k, seed, step
        self.host_f = torch.zeros(2, max_num_seqs, dtype=torch.float32, pin_memory=on_gpu)
        self.host_i = torch.zeros(3, max_num_seqs, dtype=torch.int64, pin_memory=on_gpu)
        self.dev_f, self.dev_i = self.host_f.to(self.device), self.host_i.to(self.device)
        # Only the common path is compiled: with top-k/top-p (a sort and a cumsum) torch 2.11's inductor
        # fails on dynamic shapes, so those steps run lesson 02's eager code (the same tokens).
        self.compiled_sample = torch.compile(sample, dynamic=True) if compiled else sample

    def __call__(self, logits: torch.Tensor, params: list, seeds: list[int], steps: list[int]) -> list[int]:
        n = len(params)
        f, i = self.host_f.numpy(), self.host_i.numpy()
        f[0, :n] = [p.temperature for p in params]
        f[1, :n] = [p.top_p for p in params]
        i[0, :n] = [p.top_k for p in params]
        i[1, :n] = [s % 2**63 for s in seeds]  # any Python int, as an int64
        i[2, :n] = steps
        self.dev_f[:, :n].copy_(self.host_f[:, :n], non_blocking=True)
        self.dev_i[:, :n].copy_(self.host_i[:, :n], non_blocking=True)
        filtered = any(p.top_k > 0 or p.top_p < 1 for p in params)  # known here: no need to ask the device
        temperature, top_p = self.dev_f[:, :n]
        top_k, seeds, steps = self.dev_i[:, :n]
        fn = sample if filtered else self.compiled_sample
        return fn(logits, temperature, top_k, top_p, seeds, steps, filtered).tolist()
