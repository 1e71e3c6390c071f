"""`DeviceError`: a device, dtype or cache setting this machine or model cannot take; the message says
which and what to use instead. Its own module so that the resolvers of `kvgate.core.placement` and
`kvgate.core.kv_dtype` share it without importing each other."""


class DeviceError(RuntimeError):
    pass
