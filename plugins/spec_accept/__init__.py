"""SpecAccept: truncation + acceptance of K drafts (+ grammar bitmask) per row -> accepted count, next token."""
