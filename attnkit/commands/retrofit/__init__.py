"""retrofit softcap|qknorm|qkclip: add a logit-stabilising mechanism to a checkpoint."""
