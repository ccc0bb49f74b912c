"""Built-in reasoning parsers: ``<think>`` tags (DeepSeek-R1, Qwen3) and ERNIE X1."""
