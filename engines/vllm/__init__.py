"""vLLM backends: in-process `LLM`, an attached OpenAI server, the worker extension that
runs inside every vLLM worker, vLLM's weight-transfer plugin, and LoRA slots."""
