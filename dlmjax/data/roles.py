"""What each token of an SFT row is (the `roles` batch array): the rows (train/sft_rows.py) write
these ids and the SFT loss (diffusion/sft_loss.py) reads them."""

PROMPT, RESPONSE, PADDING = 0, 1, 2
