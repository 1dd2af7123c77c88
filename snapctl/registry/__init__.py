"""Images in an OCI distribution registry: ``image push``, ``image pull``, and the local cache
``copy --image REF`` restores from.

``layout`` owns the OCI form of an image (media types, annotations, the config blob that maps
every image file to its blobs); ``chunks`` cuts page data into content-defined chunks, so a
re-bake pushes only what changed; ``client`` talks to a registry (credentials, plain HTTP,
bounded and resumable blob transfers); ``cache`` keeps verified blobs and pulled images under
the state directory; ``push`` and ``pull`` move an image, verifying every byte on the way.
"""
