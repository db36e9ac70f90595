"""Capture: a model or one op call turned into a graph whose nodes carry shapes and dtypes
(``fx``: torch.fx symbolic tracing with shape propagation), and the running of one captured
node on given values (``call``)."""
