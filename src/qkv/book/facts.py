"""The book's six-token example as plain data ("Build a Large Language Model (From Scratch)",
chapter 3), in a module that imports no torch, so `qkv explain --help` can show the
defaults without loading PyTorch. `qkv.book.walkthrough` turns them into tensors."""

BOOK_TOKENS: tuple[str, ...] = ("Your", "journey", "starts", "with", "one", "step")
BOOK_INPUTS: tuple[tuple[float, float, float], ...] = (
    (0.43, 0.15, 0.89),
    (0.55, 0.87, 0.66),
    (0.57, 0.85, 0.64),
    (0.22, 0.58, 0.33),
    (0.77, 0.25, 0.10),
    (0.05, 0.80, 0.55),
)
BOOK_QUERY_POSITION = 2  # "journey", x(2) in the book's notation (counted from 1)
BOOK_D_OUT = 2
BOOK_SEED = 123
