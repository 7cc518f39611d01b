"""Structural probes (Hewitt & Manning 2019) on cached hidden states: distance and depth probes."""
