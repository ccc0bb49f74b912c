"""Built-in tool parsers: Hermes/Qwen ``<tool_call>``, ERNIE, Llama 3 JSON, Mistral ``[TOOL_CALLS]``."""
