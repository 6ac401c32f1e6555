import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.retry.ExponentialBackoffRetry;
import org.apache.curator.framework.recipes.locks.InterProcessMutex;
import org.apache.curator.framework.recipes.locks.InterProcessReadWriteLock;
import org.apache.curator.framework.recipes.locks.InterProcessSemaphoreV2;
import org.apache.curator.framework.recipes.locks.Lease;
import java.util.concurrent.TimeUnit;

/**
 * Curator's side of the interop tests: args are connect string, path, mode, milliseconds
 * (how long to hold, or to wait), and for a semaphore its number of leases.
 *
 * Modes: hold / try (InterProcessMutex), rw-read-hold / rw-read-try / rw-write-hold /
 * rw-write-try (InterProcessReadWriteLock), sem-hold / sem-try (InterProcessSemaphoreV2).
 * A hold prints HELD, then RELEASED; a try prints GOT or BUSY.
 */
public class Interop {
  static void say(String s) { System.out.println(s); System.out.flush(); }

  public static void main(String[] a) throws Exception {
    // Retries as an application would configure them: a loaded CI machine can drop a
    // first connection (the helper once ended before saying anything).
    CuratorFramework c = CuratorFrameworkFactory.newClient(a[0], new ExponentialBackoffRetry(100, 6));
    c.start();
    if (!c.blockUntilConnected(60, TimeUnit.SECONDS)) {
      throw new IllegalStateException("no ZooKeeper connection within 60 s");
    }
    String mode = a[2];
    long ms = Long.parseLong(a[3]);
    if (mode.startsWith("sem-")) {
      InterProcessSemaphoreV2 s = new InterProcessSemaphoreV2(c, a[1], Integer.parseInt(a[4]));
      if (mode.equals("sem-hold")) {
        Lease l = s.acquire();
        say("HELD");
        Thread.sleep(ms);
        s.returnLease(l);
        say("RELEASED");
      } else {
        Lease l = s.acquire(ms, TimeUnit.MILLISECONDS);
        say(l != null ? "GOT" : "BUSY");
        if (l != null) s.returnLease(l);
      }
    } else {
      InterProcessMutex m;
      if (mode.startsWith("rw-")) {
        InterProcessReadWriteLock rw = new InterProcessReadWriteLock(c, a[1]);
        m = mode.startsWith("rw-read-") ? rw.readLock() : rw.writeLock();
      } else {
        m = new InterProcessMutex(c, a[1]);
      }
      if (mode.endsWith("hold")) {
        m.acquire();
        say("HELD");
        Thread.sleep(ms);
        m.release();
        say("RELEASED");
      } else {
        boolean got = m.acquire(ms, TimeUnit.MILLISECONDS);
        say(got ? "GOT" : "BUSY");
        if (got) m.release();
      }
    }
    c.close();
  }
}
