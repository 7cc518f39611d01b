"""Analyses beyond the four papers: ``faithfulness`` (which map kind tells what a classifier's prediction used),
``sink`` (Gu et al. 2024's attention-sink rate: how often a head's attention to the first token exceeds a
threshold, input by input)."""
