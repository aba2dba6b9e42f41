"""Fake ``transformer_engine.pytorch.utils``: the two queries TE's backend selection makes
(``get_device_compute_capability``, main d0067d0 L87; ``get_cudnn_version``, L679). Tests set
``CAPABILITY`` / ``CUDNN`` to run as another GPU or cuDNN."""

CAPABILITY = (10, 0)
CUDNN = (9, 26, 0)


def get_device_compute_capability():
    return CAPABILITY


def get_cudnn_version():
    return CUDNN
