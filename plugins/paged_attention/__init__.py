"""PagedAttention: GQA/MHA attention over a row's paged past plus this step's new K/V."""
