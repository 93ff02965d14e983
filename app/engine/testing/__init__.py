"""Fixtures for tests and benchmarks, never imported by the app (the bundle leaves them out):
random-weight models (`random_models`, `tiny`), converted folders written from random codes
(`synth`) and IsoQuant attention problems (`isoquant_problems`)."""
