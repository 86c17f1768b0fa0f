"""MNIST example: ``python -m examples.mnist.main`` and the DDP launcher ``examples.mnist.ddp_main``."""
