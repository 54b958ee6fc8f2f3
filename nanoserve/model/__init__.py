"""The model: its config, the Qwen3 forward pass, and the checkpoint loader. Knows only its config
and the attention-backend protocol; it never learns where K/V are kept."""
