"""What each verb does, one handler each, written against ``node.Node`` (the
daemon's shared parts) so that no op imports the daemon back.
"""
