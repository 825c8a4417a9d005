"""From logits to tokens and text: sampling parameters, a step's sampling, incremental
detokenization.
"""
