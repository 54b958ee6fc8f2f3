"""Attention math: torch references and Triton kernels. Imports nothing else of nanoserve."""
