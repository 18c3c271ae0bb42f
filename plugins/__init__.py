"""unispec custom ops, one folder per op. Imports nothing else of unispec."""
