"""The ``lora-func demo``: a small pretrained language model shipped with the package, a
fine-tuning task it fails, and the run that fine-tunes every variant on it.

Built on lora_func's public API only (like a user's code would be).
"""
