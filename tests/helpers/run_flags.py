"""pretrain_gpt.py flags the tests share: argv lists, or dicts in ``cli_flags``' form."""

MOCK_RUN = (
    "--model tiny --mock-data --tokenizer-type NullTokenizer --vocab-size 100 --train-iters 5 "
    "--lr 1e-3"
).split()
"""Five iterations of the ``tiny`` preset on mock data (100 ids): a run config with nothing to
read."""

ONE_LAYER = {"num-layers": 1, "hidden-size": 32, "num-attention-heads": 2, "ffn-hidden-size": 64}
"""pretrain_gpt.py's ``tiny`` preset cut to one layer of width 32 (2 heads), in ``cli_flags``'
form: the fastest run that still trains."""


def tempnet_flags(width: int, rho: float = 4) -> dict:
    """A TempNet of hidden and projection size ``width`` and the DRO's ``rho``, as the entry
    points' flags in ``cli_flags``' form."""
    return {"tempnet-hidden-size": width, "tempnet-proj-size": width, "tempnet-rho": rho}
