"""The parameter server on the driver: ParameterServer, its handle and its results."""
