"""The `vllm.general_plugins` entry point (`engines.vllm_transfer:register`): the plugin
lives in `engines.vllm.transfer`."""

from engines.vllm.transfer import register

__all__ = ["register"]
