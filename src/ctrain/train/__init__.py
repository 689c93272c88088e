"""Training inside the image: recipes, data preparation, the trainer, evaluation.

Only :mod:`ctrain.train.recipe` (and :mod:`ctrain.train.demo`) may be imported without the training
stack: a login node validates recipes with them. Everything else imports torch and friends.
"""
