"""Rank side: plain torch code that runs inside each engine (or under torchrun); never imports lab or widgets."""
