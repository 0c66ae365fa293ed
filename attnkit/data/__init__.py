"""Text attnkit ships: sample.txt, original English prose (CC0 1.0, the text of tests/data/prose/heldout.txt) that
a rewrite's self-check scores on when it has no other held-out text (attnkit.scoring.selfcheck)."""
