"""Probe architectures (components/) and the LightningModule that trains them."""
