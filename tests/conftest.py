import os

# Tests never reach the network: the HF hub is only ever read from the local cache.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
