"""parity: bitwise-parity verification harness for distributed FP8 training.

Layers, each importing only from the ones before it:
fp8 -> dist -> model -> ddp -> optim -> harness -> cli.
"""

__version__ = "0.1.0"
