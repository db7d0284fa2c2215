"""Accessors of a twinkle model's per-adapter state, shared by the Megatron and transformers paths."""


def optimizer_group(model, kwargs):
    """twinkle's optimizer group of the call's adapter (the default group without ``adapter_name``)."""
    name = kwargs["adapter_name"] if "adapter_name" in kwargs else model._get_default_group()
    return model.optimizer_group[name]


def loss_instance(model, kwargs):
    try:
        return optimizer_group(model, kwargs).loss_instance
    except (AttributeError, KeyError):
        return None  # forward_backward itself reports the bad adapter name
