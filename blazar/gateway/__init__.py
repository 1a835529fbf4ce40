"""
The gateway: the call object, the one request pipeline, admission, quotas,
scope, the error table and the operations HTTP and AMP share.
"""
