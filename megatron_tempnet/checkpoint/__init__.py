"""Checkpoints: the format and its checks, each rank's share of the state as boxes of global
tensors, the files written and read, the save (synchronous or in the background) and the load at
any layout. Below the trainer: the trainer, the model families, the inference tools and the
checkpoint tools use it; it uses none of them.

The names, throughout: ``save_dir`` and ``load_dir`` are a run's ``--save`` and ``--load``
folders (``latest`` and one folder per saved iteration); ``tag`` names one of those folders
(``iter_0000010``); ``directory`` is one checkpoint's folder (``load_dir/tag``); ``path`` is a
file's.
"""
