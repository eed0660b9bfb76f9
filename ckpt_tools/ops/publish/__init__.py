"""`ckpt push`: a checkpoint directory published to the Hub, with the probe report that travels with it."""
