"""Technique layer of ComfyUI-MemoryKit.

Everything in this package except ``comfy_integration`` is plain torch / diffusers /
accelerate / safetensors code that knows nothing of ComfyUI and can be used (and tested) on
any ``torch.nn.Module``. ``comfy_integration`` is the one module that touches
``comfy.model_patcher`` and ``comfy.model_management``.
"""
