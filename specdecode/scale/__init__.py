"""Beyond one decoding loop: dataset jobs (`specdecode batch`, locally or on Ray Data) and
replicated serving (`specdecode serve --replicas` on Ray Serve). Ray does the scheduling; this
package only turns rows into engine requests and results into output lines."""
