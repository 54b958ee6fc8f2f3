"""Where K/V live: attention backends (no cache, contiguous, paged, prefix-caching), their block
managers, and the per-step metadata they read. Built on kernels/ and the model's config."""
