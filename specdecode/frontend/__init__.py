"""The request path shared by every driver (library, server, batch job): wire schema in, engine
requests built, wire answers out."""
