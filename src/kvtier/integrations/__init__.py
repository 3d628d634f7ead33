"""Adapters between kvtier and inference engines.

Each engine gets one subpackage, the only code in kvtier that imports that engine:
``kvtier.integrations.vllm`` speaks vLLM 0.33's ``kv_offload`` API (an ``OffloadingSpec``
selected by ``spec_module_path``, and a ``SecondaryTierManager`` for vLLM's own tiering).

Importing this package imports no engine; only importing a subpackage does.
"""
