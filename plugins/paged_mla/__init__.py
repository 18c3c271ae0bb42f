"""PagedMLA: absorbed multi-head latent attention (MQA over a latent paged cache), FlashMLA-style decode core."""
