"""Broken fd-engine plugins, one per seam, for the conformance kit's own tests.

Never install them into an environment that serves: the platform's detector raises. The tests
install the package into a folder of its own (``pip install --target``) and put it on the
``PYTHONPATH`` of the ``fd-serve plugins check`` they run.
"""
