"""Training inside the image: recipes, data preparation, the trainer, evaluation.

Only :mod:`~ctrain.train.recipe`, :mod:`~ctrain.train.artifacts`, :mod:`~ctrain.train.layout`,
:mod:`~ctrain.train.sources`, :mod:`~ctrain.train.preflight`, :mod:`~ctrain.train.fingerprint`,
:mod:`~ctrain.train.health` (torch only inside its rank checks) (and
:mod:`~ctrain.train.demo`) may be imported without the training stack: a login node validates
recipes with them. Everything else imports torch and friends.
"""
