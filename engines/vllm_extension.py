"""The path vLLM's `--worker-extension-cls` takes (`engines.vllm_extension.WeightSyncExtension`):
the extension lives in `engines.vllm.extension`."""

from engines.vllm.extension import LOCAL_BUFFERS, WeightSyncExtension

__all__ = ["LOCAL_BUFFERS", "WeightSyncExtension"]
