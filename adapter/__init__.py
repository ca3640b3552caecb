"""kimi-eagle's vLLM plugin: the only code of this project that runs inside vLLM's processes."""
