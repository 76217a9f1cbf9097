"""What a penalty is for, measured (torch only, no Lightning): accuracy under attacks, mode
coverage and energy distance (:mod:`~gradreg.evaluation.metrics`), and a classifier's view of
generated images (:mod:`~gradreg.evaluation.sample_quality`). The Lightning modules log them."""
