"""Model families, each with its trainer pieces: ``gpt`` (GPT-2, LLaMA) and ``clip``.

``transformer`` holds what the families share: megatron-core's layers on the local spec.
"""
