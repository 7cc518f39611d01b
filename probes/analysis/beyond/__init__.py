"""Analyses beyond the four papers: ``faithfulness`` (which map kind tells what a classifier's prediction used)."""
