"""
The gateway: what happens to a call between the surface that decoded it and
the engines that serve it, and the model operations every front end shares.
"""
