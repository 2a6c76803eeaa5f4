"""The book's own chapter-5 run (train_model_simple, step for step) and its figure 5.12."""
