"""What a plan needs in memory: model states and a step's phases per rank (``states``), activations
measured on ``meta``, host memory while the model is built, and the estimate with its verdict and fixes."""
