"""megatron-tempnet: TempNet and the KL-DRO robust loss on megatron-core and DeepSpeed."""

__version__ = "0.2.0"
