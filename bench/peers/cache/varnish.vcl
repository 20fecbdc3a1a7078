vcl 4.1;
# Peer: Varnish 7 caching by the origin's headers (max-age=3600), 2 thread pools, malloc 1 GiB.
# Templated by cache.sh: @ORIGIN@.
backend origin {
    .host = "127.0.0.1";
    .port = "@ORIGIN@";
    .max_connections = 1000;
}
sub vcl_deliver {
    if (obj.hits > 0) { set resp.http.X-Cache = "HIT"; } else { set resp.http.X-Cache = "MISS"; }
}
